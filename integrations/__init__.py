"""witcert.integrations"""
