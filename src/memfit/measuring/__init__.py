"""The measuring stage."""
