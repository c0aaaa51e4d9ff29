"""Serving: a trained run -> one artifact (``export``), loading it with its integrity checks
(``artifact``), the programs compiled into it (``program``), and the HTTP prediction server
(``server``, with its request parsing in ``request``)."""
