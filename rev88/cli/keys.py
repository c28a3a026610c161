"""``rev88 keys create|list|revoke|rotate``: tenants' API keys, over the service's /keys with the
admin key (docs/tenants.md). A new or rotated secret is printed once, on the last line."""

from __future__ import annotations

import argparse
import json

from .common import CliError
from .tasks import add_client_flags, client_errors, open_client


@client_errors
def cmd_keys(args: argparse.Namespace) -> int:
    if args.action != "list" and not args.target:
        raise CliError(f"rev88 keys {args.action} needs the key's {'name' if args.action == 'create' else 'id'}")
    with open_client(args, args.timeout) as client:
        if args.action == "list":
            for key in client.keys():
                state = "revoked" if key["revoked_at"] else "active"
                print(f"{key['id']}  {key['prefix']}…  {key['name']}  {','.join(key['scopes'])}  {state}")
            return 0
        if args.action == "create":
            made = client.create_key(args.target, scopes=args.scopes.split(",") if args.scopes else None,
                                     expires_at=args.expires_at)
        elif args.action == "rotate":
            made = client.rotate_key(args.target, args.grace)
        else:
            print(json.dumps(client.revoke_key(args.target), indent=2))
            return 0
        shown = {k: v for k, v in made.items() if k not in ("key", "note")}
        print(json.dumps(shown, indent=2))
        print(f"# {made['note']}")
        print(made["key"])
    return 0


def add_keys(sub) -> None:
    p = sub.add_parser("keys", help="tenants' API keys on the service (create, list, revoke, rotate; the admin key)",
                       description="create NAME: a new key (its secret printed once, last line); list: every key "
                       "(never a secret); revoke ID: refused from then on; rotate ID: a new secret, the old one "
                       "valid for --grace seconds.")
    p.add_argument("action", choices=("create", "list", "revoke", "rotate"))
    p.add_argument("target", nargs="?", metavar="NAME|ID", help="create: the key's name; revoke, rotate: its id")
    p.add_argument("--scopes", help="create: comma-separated, of read, write, admin (default read,write)")
    p.add_argument("--expires-at", type=float, help="create: epoch seconds after which the key is refused")
    p.add_argument("--grace", type=float, help="rotate: seconds the old secret keeps working (default 3600)")
    add_client_flags(p, "seconds to wait for each answer (default 60)")
    p.set_defaults(func=cmd_keys)
