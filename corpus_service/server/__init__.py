"""The corpus process: start-up and serving (``main.py``), its ``ServiceConfig`` (``config.py``), the
state its gRPC servicer and REST admin share (``state.py``), the gRPC servicer and its sessions, and
the bounds on per-caller memory."""
