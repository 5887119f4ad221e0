"""Benchmark preparation (Fed-VQA, Fed-Med): raw downloads -> normalised multimodal JSONL."""
