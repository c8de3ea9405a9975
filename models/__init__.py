"""Flax NNX models (ViT, LLaMA, BERT/RoBERTa) on the memory policy. Arrive with the Models issue."""
