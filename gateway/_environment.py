"""Environment variables the admin commands and the gateway both read, outside the settings.

Apart from gateway/_config.py so that an admin command (``understudy promote``), a client of
a running gateway, does not import the configuration's models and, through them, the
evaluators: seconds of imports before ``--help`` answers.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ADMIN_CLIENT_CERT_ENV", "ADMIN_CLIENT_KEY_ENV", "ADMIN_TOKEN_ENV", "ADMIN_URL_ENV"]

ADMIN_TOKEN_ENV: Final = "UNDERSTUDY_ADMIN_TOKEN"
ADMIN_URL_ENV: Final = "UNDERSTUDY_ADMIN_URL"
# PEM files of the admin commands' client certificate, for an admin API that asks for one
# (``[admin] tls_client_ca_file``); the key may be in the certificate's file.
ADMIN_CLIENT_CERT_ENV: Final = "UNDERSTUDY_ADMIN_CLIENT_CERT"
ADMIN_CLIENT_KEY_ENV: Final = "UNDERSTUDY_ADMIN_CLIENT_KEY"
