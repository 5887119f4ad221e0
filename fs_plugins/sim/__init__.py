"""The embedded in-process runner (for machines without FederatedScope)."""
