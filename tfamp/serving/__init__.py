"""``tfamp export``: a mixed-precision SavedModel for serving, checked against float32.

One module per question: ``source`` (what is exported: a SavedModel's signatures
or a Keras file's serving function, and what each captures), ``dataflow`` (where
a tensor of the signature's graph is read, across function calls), ``weights``
(which weights can be stored in 16-bit, and the edit that stores them so),
``build`` (the 16-bit serving function on the new variables), ``inputs`` (what the
check runs on), ``accuracy`` (how far the outputs moved), ``locate`` (which nodes
to keep float32 when they moved too far), ``write`` (the SavedModel, written
atomically), ``report`` (``ExportReport``), ``api`` (``tfamp.export``).

The package is ``serving`` rather than ``export``: ``tfamp.export`` is the public
function, and a subpackage of that name would replace it as an attribute of
``tfamp`` as soon as it was imported.
"""
