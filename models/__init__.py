"""Flax NNX models (ViT, LLaMA, BERT/RoBERTa, reversible ViT/LLaMA) on the memory policy."""
