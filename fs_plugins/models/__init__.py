"""Model builders: a base model + tokenizer, LoRA via peft, then the method's own modules."""
