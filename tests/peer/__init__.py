"""The peers' own checkpointing tests (PyTorch, Hugging Face transformers, DeepSpeed), ported to
actcfg.apply and run across actcfg's routes. A package, so that their file names (test_utils,
test_checkpoint_wrapper) never clash with the project's own tests."""
