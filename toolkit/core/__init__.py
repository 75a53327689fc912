"""The bottom layer: what every other package may import (protocols; nothing here imports the toolkit)."""
