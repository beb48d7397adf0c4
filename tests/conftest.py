import os

# Short deadlines in tests: a deadlock or a lost message fails within a minute.
os.environ.setdefault("MPIGOSSIP_TIMEOUT", "60")
