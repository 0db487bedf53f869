"""Compatibility layers: other data planes' APIs over a :class:`streamrl.StreamQueue`.

* :mod:`streamrl.compat.transferqueue` -- TransferQueue 0.1.11's client API
  (``init``, ``get_client``, ``put``/``get_meta``/``get_data``, ``kv_*``, ...).

Each is imported on its own (``import streamrl.compat.transferqueue as tq``); importing
:mod:`streamrl` does not load them.
"""
