"""witcert.collector"""
