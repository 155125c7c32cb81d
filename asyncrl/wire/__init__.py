"""The wire: typed msgspec messages (``protocol``), ZeroMQ sockets and request servers, addresses and ports."""
