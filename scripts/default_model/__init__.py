"""Helpers of scripts/train_default_model.py: corpus, tokenizer, training model, export, evaluation."""
