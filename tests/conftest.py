import logging
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
logging.getLogger("lightning_partial").setLevel(logging.INFO)
