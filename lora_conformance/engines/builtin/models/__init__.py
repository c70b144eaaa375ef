"""Architectures served by the built-in engine, written from scratch on our layers."""
