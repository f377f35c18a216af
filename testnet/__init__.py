"""testnet"""
