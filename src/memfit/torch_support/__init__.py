"""The torch releases memfit supports (``releases``) and what it can do on the installed one
(``capabilities``, ``memfit.capabilities()``). Shared core, beside ``memfit._torch``, which
holds every private torch API."""
