"""What both ends of the gRPC wire share: packed arrays (``arrays.py``) and the mapping of errors to
status codes and back (``status.py``)."""
