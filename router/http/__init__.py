"""The router's HTTP side: the ASGI entry and endpoints, the proxy to engines, the errors
clients see, who may call what, and the ``serve`` process and its workers."""
