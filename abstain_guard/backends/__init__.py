"""Backends: the engines a guarded chat model generates on."""
