"""How an endpoint is reached and authenticated: where pushes may go (destinations), project
secrets, signatures' keys, OIDC and OAuth 2.0 tokens, client certificates, and the settings that say so."""
