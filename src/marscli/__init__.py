"""marscli: SenseNova-MARS (arXiv 2512.24330) as composable Unix-style stages."""

__version__ = "0.1.0"
