"""`python -m recipes.dalle fit --config configs/dalle_tiny.yaml`: the DALL-E recipe's command line."""

from recipes.cli import main

if __name__ == "__main__":
    main()
