"""The training job: ``python -m mpigossip train | compare | plot`` (see README)."""
