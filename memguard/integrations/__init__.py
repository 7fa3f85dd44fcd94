"""Callbacks for the trainers people use: the top floor of memguard.

- :mod:`memguard.integrations.lightning`: ``MemguardCallback`` for PyTorch Lightning
  (``pip install "memguard-ml[lightning]"``);
- :mod:`memguard.integrations.transformers`: ``MemguardCallback``, a Hugging Face
  ``TrainerCallback`` (``pip install "memguard-ml[transformers]"``);
- :mod:`memguard.integrations.keras`: ``MemguardCallback``, a ``keras.callbacks.Callback``
  (``pip install "memguard-ml[keras]"``).

Each module imports its framework when it is imported itself, and only then: ``import
memguard`` (and this package) imports none of them. Importing one without its framework is an
``ImportError`` that names the package to install.
"""
