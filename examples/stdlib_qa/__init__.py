"""The stdlib question-answering example: build.py builds the data and tokenizer, reward.py scores the answers."""
