"""Contrastive fine-tuning (paper section 3.4): the InfoNCE objective and a resumable training loop."""
