"""`python -m recipes.dalle fit --config configs/dalle_tiny.yaml`: the DALL-E recipe's command line."""

from recipes.cli import main
from recipes.dalle.cpu_malloc import keep_freed_memory

if __name__ == "__main__":
    keep_freed_memory()  # CPU steps reuse freed heap memory instead of page-faulting fresh pages (~20% of a step)
    main()
