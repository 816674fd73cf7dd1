"""``pdserve models``: the converted models in the cache and their folders.

Clients that tokenize on their own side (lm-eval, guidellm, aiperf) want the model's folder as their tokenizer
path: ``pdserve models --path smollm2-135m-instruct`` prints it (converting the model first if needed).
"""

from __future__ import annotations

import click


@click.command("models")
@click.option("--path", "name", default=None, metavar="NAME",
              help="Print only this model's folder, converting a known model first if it is not converted yet.")
def command(name: str | None) -> None:
    """List the converted models in the cache ($PDSERVE_CACHE_DIR or ~/.cache/pdserve) with their folders."""
    from pdserve.shared.models.resolve import cache_dir, cached_models, known_models

    cached = cached_models()
    if name is not None:
        click.echo(model_path(name, cached))
        return
    width = max((len(n) for n in [*cached, *known_models()]), default=0)
    for model, path in cached.items():
        click.echo(f"{model:<{width}}  {path}")
    for model in known_models():
        if model not in cached:
            click.echo(f"{model:<{width}}  (not converted yet: `pdserve models --path {model}` converts it)")
    if not cached:
        click.echo(f"no converted models in {cache_dir() / 'models'}", err=True)


def model_path(name: str, cached: dict) -> str:
    """The folder of a cached model by its name, else what ``resolve_model`` makes of ``name`` (a known name, which
    it converts once, a local model folder, a .gguf file); ``click.ClickException`` naming the choices when it is none of them."""
    from pdserve.shared.models.resolve import known_models, resolve_model

    if name in cached:
        return str(cached[name])
    try:
        return str(resolve_model(name))
    except FileNotFoundError as e:
        others = [n for n in cached if n not in known_models()]
        raise click.ClickException(f"--path: {e}" + (f"; converted: {', '.join(others)}" if others else "")) from None
