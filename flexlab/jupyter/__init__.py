"""Notebook layer: the ``%%flexattn`` magic, the playground widget and the result panel they share.

Imported only on use (``flexlab.Playground``, ``%load_ext flexlab``); ipywidgets and anywidget load here, not in
``import flexlab``.
"""
