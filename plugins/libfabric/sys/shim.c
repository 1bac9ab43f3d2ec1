/* See shim.h: each function is the header's static inline call, compiled once. */
#include "shim.h"

uint32_t xf_header_version(void) { return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); }
struct fi_info *xf_allocinfo(void) { return fi_allocinfo(); }
int xf_close(struct fid *fid) { return fi_close(fid); }
int xf_control(struct fid *fid, int command, void *arg) { return fi_control(fid, command, arg); }
int xf_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context) {
    return fi_fabric(attr, fabric, context);
}
int xf_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context) {
    return fi_domain(fabric, info, domain, context);
}
int xf_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context) {
    return fi_endpoint(domain, info, ep, context);
}
int xf_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context) {
    return fi_av_open(domain, attr, av, context);
}
int xf_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context) {
    return fi_cq_open(domain, attr, cq, context);
}
int xf_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags) { return fi_ep_bind(ep, bfid, flags); }
int xf_enable(struct fid_ep *ep) { return fi_enable(ep); }
int xf_getname(struct fid_ep *ep, void *addr, size_t *addrlen) { return fi_getname(&ep->fid, addr, addrlen); }
int xf_setname(struct fid_ep *ep, void *addr, size_t addrlen) { return fi_setname(&ep->fid, addr, addrlen); }
int xf_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags,
                 void *context) {
    return fi_av_insert(av, addr, count, fi_addr, flags, context);
}
int xf_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags) {
    return fi_av_remove(av, fi_addr, count, flags);
}
int xf_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
              uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context) {
    return fi_mr_reg(domain, buf, len, access, offset, requested_key, flags, mr, context);
}
uint64_t xf_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }
void *xf_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
int xf_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags) { return fi_mr_bind(mr, bfid, flags); }
int xf_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }
int xf_cntr_open(struct fid_domain *domain, struct fi_cntr_attr *attr, struct fid_cntr **cntr, void *context) {
    return fi_cntr_open(domain, attr, cntr, context);
}
uint64_t xf_cntr_read(struct fid_cntr *cntr) { return fi_cntr_read(cntr); }
ssize_t xf_cq_read(struct fid_cq *cq, void *buf, size_t count) { return fi_cq_read(cq, buf, count); }
ssize_t xf_cq_sread(struct fid_cq *cq, void *buf, size_t count, const void *cond, int timeout) {
    return fi_cq_sread(cq, buf, count, cond, timeout);
}
int xf_cq_signal(struct fid_cq *cq) { return fi_cq_signal(cq); }
ssize_t xf_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags) {
    return fi_cq_readerr(cq, buf, flags);
}
const char *xf_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len) {
    return fi_cq_strerror(cq, prov_errno, err_data, buf, len);
}
ssize_t xf_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags) {
    return fi_readmsg(ep, msg, flags);
}
ssize_t xf_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags) {
    return fi_writemsg(ep, msg, flags);
}
ssize_t xf_send(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr, void *context) {
    return fi_send(ep, buf, len, desc, dest_addr, context);
}
ssize_t xf_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr, void *context) {
    return fi_recv(ep, buf, len, desc, src_addr, context);
}
