"""Representations (paper section 3.2): backbones, prompts, readouts (DiffRetriever's mask readout and the
baselines), sparse vocabulary vectors."""
