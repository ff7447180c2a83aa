"""`python -m recipes.clip fit --config configs/clip_tiny.yaml`: train the tiny CLIP reranker (LightningCLI)."""

from lightning.pytorch.cli import LightningCLI

from recipes.cli import RecipeTrainer
from recipes.clip.data import ShapesCLIPDataModule
from recipes.clip.module import CLIPModule


def main(args=None) -> None:
    LightningCLI(CLIPModule, ShapesCLIPDataModule, trainer_class=RecipeTrainer, args=args,
                 save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
