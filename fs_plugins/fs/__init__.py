"""FederatedScope binding. Only `autoload` is imported at interpreter start (it imports
nothing heavy); everything else loads when FederatedScope itself is imported."""
