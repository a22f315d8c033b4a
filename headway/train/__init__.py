"""headway.train"""
