"""``python -m ddp_notebook.worker``: the rank entry point of earlier versions, kept for ranks started by them."""
from .rank.worker import main

if __name__ == "__main__":
    main()
