"""lightning-grpo: GRPO for PyTorch Lightning."""
