"""`python -m recipes.clip fit --config configs/clip_tiny.yaml`: train the tiny CLIP reranker (LightningCLI)."""

from recipes.cli import main

if __name__ == "__main__":
    main()
