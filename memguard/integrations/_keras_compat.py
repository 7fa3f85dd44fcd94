"""Every private Keras API memguard uses, in one place, each with the version it was checked
against: where a Keras release moves one, this is the module to change.

Nothing here imports Keras.
"""

from __future__ import annotations

CHECKED_WITH = "3.15.1"
"""The Keras version (over TensorFlow 2.21.0) every entry below was checked against."""


# -- callbacks (checked with Keras 3.15.1) ------------------------------------------------------
CALLBACK_MODEL = "_model"
"""The attribute where ``Callback.set_model`` keeps the model at ``fit`` (its ``model``
property reads it): a link to the run, left out when a callback is pickled or copied."""
