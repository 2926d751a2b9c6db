"""How the command-line clients of the router present themselves: one set of flags, one reader.

Every command that dials the router (`generate --router`, `chat`, `status`, `loadtest`) takes

    --tls-ca FILE                          dial with TLS, trusting this CA (e.g. certs/ca.pem)
    --tls-client-cert FILE --tls-client-key FILE
                                           the certificate shown to a mutual-TLS router
    --api-token-file FILE | --api-token-env NAME
                                           the bearer token (a file of one line, or a variable)

and security_from_args() turns them into a client SecurityConfig (pdserve/security/), whose
channel_credentials() and client_metadata(internal=False) feed PdserveClient's
credentials= and metadata=, and whose open_channel(..., internal=False) gives a raw channel.
No flag given = plaintext without a token, as before.

NOTE: only argparse here at import time; `pdserve --help` builds every command's parser and
must not load gRPC, so the security package is imported when the flags are read.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.security import SecurityConfig

DESTS = ("tls_ca", "tls_client_cert", "tls_client_key", "api_token_file", "api_token_env")


def add_client_security_arguments(p: argparse.ArgumentParser) -> None:
    """The flags, in their own help section; the same names and help on every command."""
    group = p.add_argument_group(
        "security", "for a router started with TLS or API tokens (docs/security.md); "
                    "none given = plaintext, no token")
    group.add_argument("--tls-ca", metavar="FILE",
                       help="dial the router with TLS, trusting the CA in FILE (e.g. certs/ca.pem from "
                            "`python -m pdserve.security.certs`)")
    group.add_argument("--tls-client-cert", metavar="FILE",
                       help="client certificate to present to a router that requires mutual TLS "
                            "(with --tls-client-key and --tls-ca)")
    group.add_argument("--tls-client-key", metavar="FILE", help="private key of --tls-client-cert")
    token = group.add_mutually_exclusive_group()
    token.add_argument("--api-token-file", metavar="FILE",
                       help="send the API token in FILE (one line; # comments skipped) as "
                            "'authorization: Bearer <token>'")
    token.add_argument("--api-token-env", metavar="NAME",
                       help="send the API token held in the environment variable NAME")


def security_from_args(args: argparse.Namespace) -> SecurityConfig:
    """A client SecurityConfig from the flags; ValueError (a usage error) names a bad one."""
    from pdserve.security import SecurityConfig, TLSConfig, read_secret

    token = read_secret(file=args.api_token_file, env_name=args.api_token_env, what="API token")
    tls = TLSConfig(ca=args.tls_ca) if args.tls_ca is not None else None
    return SecurityConfig(tls=tls, client_cert=args.tls_client_cert, client_key=args.tls_client_key,
                          api_tokens=(token,) if token is not None else ())


def client_kwargs(security: SecurityConfig) -> dict[str, Any]:
    """PdserveClient / AsyncPdserveClient keywords that dial as security says."""
    return {"credentials": security.channel_credentials(),
            "metadata": security.client_metadata(internal=False)}


def given_flags(args: argparse.Namespace) -> list[str]:
    """The security flags given on this command line, as --names (for 'applies to --router only')."""
    return ["--" + dest.replace("_", "-") for dest in DESTS if getattr(args, dest, None) is not None]
