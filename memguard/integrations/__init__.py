"""Callbacks for the trainers people use: :mod:`memguard.integrations.lightning`,
:mod:`memguard.integrations.transformers` and :mod:`memguard.integrations.keras`
(``pip install "memguard-ml[lightning]"``, ``[transformers]``, ``[keras]``).

Each imports its framework when imported itself; ``import memguard`` imports none.
Importing one without its framework is an ``ImportError`` naming the package to install."""
