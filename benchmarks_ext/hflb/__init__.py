"""HFLB (FedMosaic Table 13): nine VQA clients with four PFL-Dynamic tasks each, prepared from
local raw files into one normalised multimodal JSONL (`prepare.py`)."""
