"""The old name of ``gateway._scorekeeper.Scorekeeper``, kept only for ``gateway/_app.py``.

``_app.py`` is being edited by another engineer; once it imports ``Scorekeeper`` from
``gateway._scorekeeper``, this module goes (nothing else may import it).
"""

from gateway._scorekeeper import Scorekeeper as Evaluation

__all__ = ["Evaluation"]
