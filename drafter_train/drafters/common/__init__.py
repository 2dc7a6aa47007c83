"""What several drafter kinds share (target-feature models, cut models, block distillation, loading)."""
