"""End-to-end example models (``zoo.py``) and their tests."""
