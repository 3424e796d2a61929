"""`make chaos`: one TrainingJob on real pods through each fault a cluster throws (see
__main__.py); the e2e tests run a subset (tests/e2e/test_chaos.py)."""
