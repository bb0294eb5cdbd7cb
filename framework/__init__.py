"""A TensorFlow 2 training framework where memory is first-class.

Library packages (`framework.remat`, `framework.memory`, `framework.models`, `framework.data`)
import neither gin nor the trainer; `framework.train` is the binary that ties them together.
"""

__version__ = "0.1.0"
