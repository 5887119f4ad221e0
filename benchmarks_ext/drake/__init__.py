"""DRAKE (FedMosaic Table 34): ten clients with four multi-modal tasks each, prepared from local
per-task instruction files into one normalised multimodal JSONL (`prepare.py`)."""
