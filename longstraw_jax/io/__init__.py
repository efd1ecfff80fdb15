"""Files: Hugging Face <-> Orbax conversion (convert), Orbax init directories and training checkpoints (checkpoints),
the PEFT adapter export (peft), all-or-nothing directory replacement (replace_dir) and the test-only fault hooks."""
