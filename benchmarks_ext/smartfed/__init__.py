"""SmartFed's skill-composition tasks (paper Table 4: MGSM, DoIT, GSM-Hard), prepared from local
downloads into instruction-record JSONL files (`prepare.py`)."""
