"""The reference backend: pure NumPy, float64 by default. The oracle every other
backend is checked against: slow, and obviously correct."""
