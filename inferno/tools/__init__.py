"""Development tools that serve the engine from beside it: random-weight models in Hugging Face format
(`inferno make-model`) and the synthetic tokenizer they ship with."""
